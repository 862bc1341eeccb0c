"""Operations: logs with rank and phase, the GC pause, Prometheus metrics, terminal progress, the bounded cache."""
