import torch


def merge(o1, lse1, o2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # a row that saw no key
    return (o1 * torch.exp(lse1 - safe)[:, None] + o2 * torch.exp(lse2 - safe)[:, None]), lse
