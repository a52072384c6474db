-- What a replay needs to re-drive a failed document version without its source: the header the
-- failing stage received (title, source, ACL, ...). Its content is the staged row of that version.
ALTER TABLE document_failures ADD COLUMN header jsonb;
