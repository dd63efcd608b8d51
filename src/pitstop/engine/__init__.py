"""Layer 5: plan -> stage -> persist -> commit; read, verify and restore.

``engine.verify`` and ``engine.catalog`` import without torch (for the CLI);
the rest imports torch.
"""
