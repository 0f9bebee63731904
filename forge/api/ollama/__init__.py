"""Ollama's API: its wire schema (ollama_schema.py) and response shapes (ollama_output.py)."""
