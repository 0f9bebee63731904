"""OpenAI's completions and chat completions (with /generate, /tokenize, /detokenize): schema, preparation,
output."""
