"""Operations: metrics and their vLLM aliases, /stats and the dashboard, logging, what an LLM router asks a
replica."""
