"""The HTTP front end: the OpenAI-compatible API, its request and response schemas, admission,
streaming, and the API processes."""
