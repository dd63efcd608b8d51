"""Integrations with training frameworks (optional extras): Hugging Face, Lightning."""
