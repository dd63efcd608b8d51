"""Layer 5: plan -> stage -> persist -> commit; the catalog (statuses, pins, retention, gc);
recovery (restore with fallback and timelines); read, verify and restore.

``engine.verify``, ``engine.catalog`` and ``engine.recovery`` import without torch (for the
CLI); the rest imports torch.
"""
