"""From a model name to weights on disk: resolving and converting models (the embedded default, GGUF
files), reading configs, weights and tokenizers, and loading."""
