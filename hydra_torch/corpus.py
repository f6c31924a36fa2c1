"""hydra_torch.corpus: the demo's offline text and tokenizer (see hydra_torch.demo.corpus)."""
from hydra_torch.demo.corpus import lm_batches, local_text, train_tokenizer

__all__ = ["local_text", "train_tokenizer", "lm_batches"]
