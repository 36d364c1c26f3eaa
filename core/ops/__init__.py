"""The op vocabulary (:mod:`.vocabulary`), op params (:mod:`.params`) and the per-backend op table (:mod:`.table`)."""
