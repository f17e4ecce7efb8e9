"""Expert providers behind one declared interface (base.py), owned by the Runtime: resident (a
Hugging Face folder in RAM), streaming (the store's slot cache), mmap, GPU, and the predicting
wrapper. Their configs and the one budget rule are in config.py."""
