"""Every checkpoint concern of SlideDP, read from an engine through :class:`~.engine_view.EngineView` and knowing
no adapter:

* :mod:`.distributed`: the distributed format (every rank writes its pieces of the ledger with
  ``torch.distributed.checkpoint``), its metadata, format checks and resume;
* :mod:`.full`: the full format (one file of state dicts from rank 0);
* :mod:`.files`: atomic swap into place, hashes and checksums, full-disk errors;
* :mod:`.ranges`: reading any element range of a stored tensor;
* :mod:`.json_codec`: the metadata's JSON, which cannot run code when it is read;
* :mod:`.fabric`: ``fabric.save`` / ``fabric.load`` in either format.
"""
