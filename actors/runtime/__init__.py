"""The engine as actors: the tokenizer, scheduler, allocator and model-worker actors (the encoder actor for an
embedding model), one model's set wired, the model set, the handle and stream demultiplexer the routes read
through, the KV-event publisher."""
