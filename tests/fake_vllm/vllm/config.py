class KVTransferConfig:
    def __init__(self, **kw):
        self.kw = kw
