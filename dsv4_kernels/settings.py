"""Every ``DSV4_*`` environment switch, typed and parsed once (issue 31, item 1).

Work in progress.
"""
