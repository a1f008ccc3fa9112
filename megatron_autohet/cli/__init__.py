"""The `autohet` command. Each sub-command is a thin module: parse, call the library, print.

main        the entry point: the parser of every sub-command, one error line for bad input
plan, compare, show, replan, profile   planning: `autohet plan/compare/show/replan/profile`
train       `autohet train`: the job's flags, checked once, then the local launcher or a rank
megatron_flags   Megatron-LM's flags `autohet train` does not take, each with what to use instead
torchrun    `autohet torchrun`: torchrun for pretrain_gpt.py --autohet-plan, its checks made first
node, rendezvous, watch   spot fleets: a node's torchrun agent, the rendezvous store, notices
warm        a node's warm fork server (imports done) and the client torchrun starts per worker
checkpoint  `autohet checkpoint ls/verify/convert`
_common     what the planning commands share: loading and checking inputs, the plan table
_table      plain-text tables
"""
