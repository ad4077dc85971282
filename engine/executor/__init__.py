"""Running forwards: the model runner, its batches and inputs, CUDA graphs and their capture,
overlap scheduling, host-to-device copies, prompt embeddings and tensor dumps."""
