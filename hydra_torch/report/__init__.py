"""What a run returns: results and trace, and their charts."""
