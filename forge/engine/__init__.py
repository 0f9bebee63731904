"""The engine: the request side of the step loop, the scheduler and its policies, sequences, the block allocator
and its KV events, the cache plan, the model runner, and the assembly of them all."""
