"""Expert parallelism: the experts of a mixture-of-experts model spread over ranks."""
