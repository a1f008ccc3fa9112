"""Glue for Megatron-LM's ``pretrain_gpt.py`` (tag core_v0.16.1).

``args.add_autohet_args`` adds the ``--autohet-*`` flags through ``extra_args_provider``;
``flags`` is the one allow-list of Megatron-LM's own flags ``--autohet-plan`` honours;
``hooks`` holds what the small patch under ``patches/`` calls from Megatron-LM (see
patches/README.md for the exact changes and why each one is needed).
"""
