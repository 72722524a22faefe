"""The experts as the checkpoint stores them: the host expert pool (``pool``), per-quantization-method formats (``formats``) and the FTW files (``ftw``)."""
