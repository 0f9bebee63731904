"""OpenAI's embeddings API: the request, its preparation and its output."""
