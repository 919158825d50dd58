"""Supervised (SFT) and preference (DPO) fine-tuning from data files."""
