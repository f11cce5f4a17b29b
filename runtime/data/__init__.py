"""Events and what is computed over one of them: the envelope and its batch encoding
(`events`), stream logic (`logic`), the WHERE compiler and consumer filters (`query`), per-key
compaction (`compaction`) and which ad-hoc SQL may run (`sql_check`). All pure."""
