"""The experts as the checkpoint stores them: per-quantization-method formats (``formats``)."""
