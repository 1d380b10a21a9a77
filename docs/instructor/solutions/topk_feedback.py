def topk_feedback(grad, error, k):
    acc = grad + error                 # what was not sent before is owed now
    indices = acc.abs().topk(k).indices
    values = acc[indices]
    acc[indices] = 0                   # the rest is the new memory
    return values, indices, acc
