"""The OpenAI-compatible /v1 routes: requests checked, answers and logprobs in OpenAI's shapes."""
