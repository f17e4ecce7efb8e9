"""Hugging Face checkpoints in, expert stores out."""
