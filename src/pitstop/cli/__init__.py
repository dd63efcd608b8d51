"""Layer 7: the ``pitstop`` command line (``main``) and the demo."""
