"""`pdcluster bench serving`: a load generator for any OpenAI-compatible endpoint (pdcluster's,
vLLM's, SGLang's).

A run sends one dataset of prompts as streaming requests at a request rate (Poisson arrivals),
records each request's TTFT, inter-token latencies and end-to-end latency, and reports throughput,
latency percentiles and goodput per rate. The modules, in the order a run uses them:

- `datasets`: random, built-in chat (`chat_conversations`), file or shared-prefix prompts ->
  `BenchRequest`s; multiturn conversations -> `ConversationScript`s (`dataset_args`: the flags)
- `tokenizer`: which tokenizer measures prompt and output lengths
- `client` and `stream_events`: one streaming request -> `RequestResult`
- `runner`: the arrival schedule, the concurrency limit, progress and interruption -> `RunResult`;
  `conversation_runner` the same for conversations, each turn carrying the server's answers
- `metrics`: percentiles, goodput -> `RunSummary`
- `report`: the stdout tables, results.jsonl / requests.jsonl, the latency-vs-rate plot
- `cli`: the flags, and one sweep over the request rates
"""
