"""The example notebook executes from top to bottom."""
import os

import nbclient
import nbformat

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "examples", "model_selection.ipynb")


def test_model_selection_notebook_executes():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert "best:" in outputs and "best adapter: r" in outputs
    assert any("image/png" in o.get("data", {}) for cell in notebook.cells for o in cell.get("outputs", []))
