import torch
import torch.distributed as dist


def train_pipeline_1f1b(part, stage, batches, microbatches, act_shape, lr):
    losses = []
    for x, y in batches:
        xs, ys = x.chunk(microbatches), y.chunk(microbatches)
        kept, sends, total = {}, [], 0.0
        for kind, i in one_f_one_b(stage, 2, microbatches):
            if kind == "F" and stage == 0:
                out = part(xs[i])
                sends.append(dist.isend(out.detach(), dst=1))  # posted, not waited for
                kept[i] = out
            elif kind == "F":
                act = torch.empty(act_shape)
                dist.recv(act, src=0)
                act.requires_grad_()  # so that backward gives the gradient stage 0 waits for
                loss = ((part(act) - ys[i]) ** 2).mean() / microbatches  # a share of the mean
                kept[i] = (act, loss)
                total += loss.item()
            elif stage == 0:
                grad = torch.empty(act_shape)
                dist.recv(grad, src=1)
                kept.pop(i).backward(grad)
            else:
                act, loss = kept.pop(i)
                loss.backward()
                sends.append(dist.isend(act.grad, dst=0))
        for work in sends:  # every send received before the step ends
            work.wait()
        with torch.no_grad():  # every micro-batch's gradient summed: the whole batch's
            for p in part.parameters():
                p -= lr * p.grad
                p.grad = None
        losses.append(total)
    return losses
