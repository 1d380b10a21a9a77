def shard_rows(batch_size, rank, world_size):
    per = batch_size // world_size
    return range(rank * per, (rank + 1) * per)
