"""The co-serving scheduler loop and the in-process API the server and benchmarks use."""
