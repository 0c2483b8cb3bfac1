# karpathy/makemore, vendored (see makemore.py's header).
