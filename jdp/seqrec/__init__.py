"""DPFormer: DP sequential recommendation (Transformer with Re-Attention, GRU/LSTM baselines)."""
