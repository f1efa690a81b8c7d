//! Shared test helpers: the known-answer vector file reader.

#![allow(dead_code)]

use std::collections::HashMap;

/// One record of a vector file: `name = hex` lines, values decoded lazily.
pub struct Record {
    pub label: String,
    fields: HashMap<String, String>,
}

impl Record {
    /// The hex field `name` as bytes.
    pub fn bytes(&self, name: &str) -> Vec<u8> {
        let hex = self
            .fields
            .get(name)
            .unwrap_or_else(|| panic!("{}: no field '{name}'", self.label));
        hex::decode(hex)
            .unwrap_or_else(|e| panic!("{}: field '{name}' is not hex: {e}", self.label))
    }

    /// The raw text of field `name`, if present.
    pub fn text(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }
}

/// Read `tests/vectors/<file>`: records separated by blank lines, `#` comments ignored.
pub fn read_vectors(file: &str) -> Vec<Record> {
    let path = format!("{}/tests/vectors/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut records = Vec::new();
    for block in text.split("\n\n") {
        let mut fields = HashMap::new();
        for line in block.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, value) = line
                .split_once('=')
                .unwrap_or_else(|| panic!("{path}: line without '=': {line}"));
            fields.insert(name.trim().to_owned(), value.trim().to_owned());
        }
        if let Some(label) = fields.get("vector").cloned() {
            records.push(Record { label, fields });
        }
    }
    assert!(!records.is_empty(), "{path}: no records");
    records
}
