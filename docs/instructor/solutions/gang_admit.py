def gang_admit(queue, free, running, backfill):
    started, ends = [], list(running)
    waiting = list(queue)
    while waiting and waiting[0][1] <= free:   # first come, first served, all GPUs at once
        name, gpus, hours = waiting.pop(0)
        started.append(name)
        free -= gpus
        ends.append((gpus, hours))             # its end frees GPUs for the reservation too
    if not backfill or not waiting:
        return started                         # the first job that does not fit holds the line
    need = waiting[0][1]
    shadow, have = 0, free                     # when the first waiting job can start
    for gpus, left in sorted(ends, key=lambda job: job[1]):
        if have >= need:
            break
        shadow, have = left, have + gpus
    spare = have - need                        # GPUs it will not need then
    for name, gpus, hours in waiting[1:]:
        if gpus > free:
            continue
        if hours <= shadow:                    # done before the reservation
            started.append(name)
            free -= gpus
        elif gpus <= spare:                    # runs past it, on GPUs the first job leaves
            started.append(name)
            free -= gpus
            spare -= gpus
    return started
