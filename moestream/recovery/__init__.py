"""Edge0's recovery stages for prediction as routing: the unmerged LoRA adapter and its file
(`adapter.py`), the student path over a whole window (`student.py`) and its training: stage 2
distillation on corpus text, stage 3 on-policy reverse KL (`train.py`)."""
