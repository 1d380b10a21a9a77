"""Context parallelism: the sequence split over ranks, attention computed across them."""
