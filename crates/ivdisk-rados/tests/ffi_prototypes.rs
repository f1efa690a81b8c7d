//! Our `extern "C"` declarations of librados and librbd against the installed headers
//! (librados-dev, librbd-dev): every function we declare exists there, takes as many
//! parameters, and returns `void` exactly when the header says so. The FFI is written by
//! hand (no bindgen at build time); a declaration that disagreed with the library went
//! unnoticed by the compiler: `rados_aio_ioctx_selfmanaged_snap_create` is `void` but was
//! declared returning `c_int`, and the garbage read from the return register was now and
//! then taken for a refusal, freeing a completion librados still wrote into.
//!
//! One test for both crates: ivdisk-rbd's FFI sits on librados' types, and its header is
//! installed with librados'.

use std::path::Path;

/// A declared function: its name, how many parameters it takes, whether it returns nothing.
#[derive(Debug, PartialEq)]
struct Prototype {
    name: String,
    params: usize,
    returns_void: bool,
}

/// The text between the `(` at `open` and its matching `)`, and the index after the `)`.
fn parenthesized(text: &str, open: usize) -> (&str, usize) {
    let mut depth = 0;
    for (i, c) in text[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return (&text[open + 1..open + i], open + i + 1);
                }
            }
            _ => {}
        }
    }
    panic!("unbalanced parentheses from byte {open}");
}

/// Parameters in a parameter list (top-level commas; `void` alone or nothing is none).
fn count_params(list: &str) -> usize {
    let list = list.trim();
    if list.is_empty() || list == "void" {
        return 0;
    }
    let mut depth = 0;
    let mut count = 1;
    for c in list.chars() {
        match c {
            '(' | '<' => depth += 1,
            ')' | '>' => depth -= 1,
            ',' if depth == 0 => count += 1,
            _ => {}
        }
    }
    // A trailing comma (rustfmt's style) opens no parameter.
    if list.ends_with(',') {
        count -= 1;
    }
    count
}

/// `pub fn NAME(...) [-> T];` in our FFI module's extern blocks.
fn rust_prototypes(source: &str) -> Vec<Prototype> {
    let mut found = Vec::new();
    let mut rest = 0;
    while let Some(at) = source[rest..].find("pub fn ") {
        let start = rest + at + "pub fn ".len();
        let open = start + source[start..].find('(').unwrap();
        let name = source[start..open].trim().to_owned();
        let (params, after) = parenthesized(source, open);
        let tail = source[after..].trim_start();
        rest = after;
        // Only declarations (ending in `;`), not the safe wrappers' bodies.
        let end = match tail.find([';', '{']) {
            Some(end) if tail.as_bytes()[end] == b';' => end,
            _ => continue,
        };
        if !(name.starts_with("rados_") || name.starts_with("rbd_")) {
            continue;
        }
        found.push(Prototype {
            name,
            params: count_params(params),
            returns_void: !tail[..end].trim_start().starts_with("->"),
        });
    }
    found
}

/// The header's declaration of `name`: `MACRO RET name(PARAMS);`, the return type being what
/// follows the export macro.
fn c_prototype(header: &str, macro_name: &str, name: &str) -> Option<Prototype> {
    let mut rest = 0;
    while let Some(at) = header[rest..].find(name) {
        let at = rest + at;
        rest = at + name.len();
        let before_ok = header[..at]
            .chars()
            .last()
            .is_some_and(|c| !(c.is_alphanumeric() || c == '_'));
        let after = header[rest..].trim_start();
        if !before_ok || !after.starts_with('(') {
            continue;
        }
        // The declaration starts at the export macro, with nothing but a return type between.
        let Some(m) = header[..at].rfind(macro_name) else {
            continue;
        };
        let ret = header[m + macro_name.len()..at].replace("CEPH_RBD_DEPRECATED", "");
        if ret.contains(';') || ret.contains('}') || ret.contains('(') {
            continue;
        }
        let open = rest + (header[rest..].len() - after.len());
        let (params, _) = parenthesized(header, open);
        return Some(Prototype {
            name: name.to_owned(),
            params: count_params(params),
            returns_void: ret.split_whitespace().collect::<Vec<_>>() == ["void"],
        });
    }
    None
}

fn check(ffi: &Path, header: &Path, macro_name: &str) -> Vec<String> {
    let source = std::fs::read_to_string(ffi).unwrap();
    let header_text = std::fs::read_to_string(header).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (install librados-dev and librbd-dev: scripts/install-deps.sh)",
            header.display()
        )
    });
    let ours = rust_prototypes(&source);
    assert!(ours.len() > 10, "{}: only {ours:?}", ffi.display());
    let mut wrong = Vec::new();
    for declared in ours {
        match c_prototype(&header_text, macro_name, &declared.name) {
            Some(theirs) if theirs == declared => {}
            Some(theirs) => wrong.push(format!("{declared:?} but the header has {theirs:?}")),
            None => wrong.push(format!("{} is not in {}", declared.name, header.display())),
        }
    }
    wrong
}

#[test]
fn the_ffi_declarations_match_librados_h_and_librbd_h() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut wrong = check(
        &crates.join("ivdisk-rados/src/ffi.rs"),
        Path::new("/usr/include/rados/librados.h"),
        "CEPH_RADOS_API",
    );
    wrong.extend(check(
        &crates.join("ivdisk-rbd/src/ffi.rs"),
        Path::new("/usr/include/rbd/librbd.h"),
        "CEPH_RBD_API",
    ));
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// The parser itself: a `void` function declared returning a value is caught.
#[test]
fn a_void_function_declared_with_a_return_value_is_caught() {
    let header = "CEPH_RADOS_API void\nrados_f(rados_ioctx_t io,\n  uint64_t x);\n\
                  CEPH_RADOS_API int rados_g(void);";
    let source = "extern \"C\" {\n pub fn rados_f(io: rados_ioctx_t, x: u64) -> c_int;\n \
                  pub fn rados_g() -> c_int;\n}\npub fn rados_h(&self) -> u64 { 0 }";
    let ours = rust_prototypes(source);
    assert_eq!(ours.len(), 2, "{ours:?}");
    let f = c_prototype(header, "CEPH_RADOS_API", "rados_f").unwrap();
    assert_eq!((f.params, f.returns_void), (2, true));
    assert!(f != ours[0]);
    assert!(c_prototype(header, "CEPH_RADOS_API", "rados_g").unwrap() == ours[1]);
}
