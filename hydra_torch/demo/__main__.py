import sys

from hydra_torch.demo.job import main

sys.exit(main())
