"""Apps the benchmarks serve with a real uvicorn."""
