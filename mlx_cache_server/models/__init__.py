"""Where weights come from: loading a model folder, GGUF import, the embedded default model."""
