"""forge's serving benchmarks over HTTP: a client of the daemon (or any OpenAI-compatible server),
not part of it. `forge bench serve|compare` runs them (forge_bench.bench_cli; the servers compare starts
and stops: forge_bench.servers); the offline benchmark of the core is forge.offline_bench.
"""
