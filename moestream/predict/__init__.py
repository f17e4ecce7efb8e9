"""Routing predictors (one file each behind `base.Predictor`), the prefetching provider wrapper
(`pipeline.py`), prerouter distillation (`train.py`) and offline recall over traces (`recall.py`)."""
