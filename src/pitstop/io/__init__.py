"""Layer 2: moving bytes on one host (arena, parallel O_DIRECT writer and reader, atomic files)."""
