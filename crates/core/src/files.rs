//! Files Stitch writes and files it trusts, made safe against other users of the host: Stitch
//! runs as root, so a file it writes through a name another user planted (a symlink, a hard
//! link, a file of theirs) or a file it believes that another user wrote is a way in.
//!
//! - Written whole ([`write_atomically`]): through a temporary name of its own, opened with
//!   `O_CREAT|O_EXCL|O_NOFOLLOW` in the same folder, given its mode explicitly and renamed over
//!   the file: a reader sees the old file or the new one, never a planted one.
//! - Written as a stream ([`create_output`]: captures): opened with `O_NOFOLLOW`, refused unless
//!   it is a regular file of this user's with one name, emptied and given its mode.
//! - Trusted ([`check_trusted`], [`read_trusted`]: state files, graph files, token files): as
//!   sshd's StrictModes, the file and every folder above it must belong to this user or root and
//!   be writable by nobody else (a sticky folder such as /tmp may stand above the file's own
//!   folder, not be it).
//! - Folders of its own ([`private_dir`]: the runtime folder): created with their mode, or
//!   refused when they exist and belong to another user; the mode is set, not left to the umask.

use std::fs::File;
use std::io::{Error, ErrorKind, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Mode bits for "writable by the group or by others".
const WRITABLE_BY_OTHERS: u32 = 0o022;

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether `uid` may be trusted with what this process reads: itself or root.
fn trusted_owner(uid: u32) -> bool {
    uid == euid() || uid == 0
}

fn folder_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Refuses `path` unless nobody but this user (or root) can have written it: the file (when it
/// exists) and each folder above it belong to this user or root and are writable by no one
/// else; a sticky folder (such as /tmp) is allowed above the file's own folder. `what` names the
/// file in the reason ("state file").
pub fn check_trusted(path: &Path, what: &str) -> Result<(), String> {
    let absolute =
        std::path::absolute(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    match std::fs::symlink_metadata(&absolute) {
        Ok(m) => {
            if m.file_type().is_symlink() {
                return Err(format!(
                    "{what} {} is a symbolic link: give the file itself",
                    path.display()
                ));
            }
            check_owner_and_mode(&m, &absolute, what, false)?;
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(format!("{what} {}: {e}", path.display())),
    }
    check_trusted_folder(
        &folder_of(&absolute),
        &format!("the folder of {what} {}:", path.display()),
    )
}

/// [`check_trusted`] of the file `path` names, its links followed (a graph file may be a link
/// to the operator's copy).
pub fn check_trusted_target(path: &Path, what: &str) -> Result<(), String> {
    let real =
        std::fs::canonicalize(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    check_trusted(&real, what)
}

/// Refuses folder `dir` unless it and every folder above it belong to this user or root and
/// are writable by no one else (a sticky folder such as /tmp may stand above it, not be it).
/// `what` begins the reason.
pub fn check_trusted_folder(dir: &Path, what: &str) -> Result<(), String> {
    let real = std::fs::canonicalize(dir).map_err(|e| format!("{what} {}: {e}", dir.display()))?;
    for (i, d) in real.ancestors().enumerate() {
        let m = std::fs::metadata(d).map_err(|e| format!("{what} {}: {e}", d.display()))?;
        check_owner_and_mode(&m, d, what, i > 0)?;
    }
    Ok(())
}

fn check_owner_and_mode(
    m: &std::fs::Metadata,
    path: &Path,
    what: &str,
    sticky_allowed: bool,
) -> Result<(), String> {
    if !trusted_owner(m.uid()) {
        return Err(format!(
            "{what} {} belongs to uid {}, not to this user (uid {}) or root: anyone who owns it decides what Stitch reads; give one of your own",
            path.display(),
            m.uid(),
            euid()
        ));
    }
    let mode = m.mode();
    let sticky = mode & libc::S_ISVTX != 0;
    if mode & WRITABLE_BY_OTHERS != 0 && !(sticky_allowed && sticky && m.is_dir()) {
        return Err(format!(
            "{what} {} is writable by other users (mode {:o}): `chmod go-w` it, or use a folder only you can write (such as /var/lib/stitch)",
            path.display(),
            mode & 0o7777
        ));
    }
    Ok(())
}

/// Reads a file Stitch trusts (its own state, a token): `None` when it does not exist; refused
/// when it is a symbolic link, or when [`check_trusted`] refuses it; with `private`, also when
/// others may read it (a secret).
pub fn read_trusted(path: &Path, what: &str, private: bool) -> Result<Option<Vec<u8>>, String> {
    check_trusted(path, what)?;
    let mut f = match File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {what} {}: {e}", path.display())),
    };
    // The checks again on what was opened: the name may have been swapped since.
    let m = f
        .metadata()
        .map_err(|e| format!("cannot read {what} {}: {e}", path.display()))?;
    check_owner_and_mode(&m, path, what, false)?;
    if !m.is_file() {
        return Err(format!("{what} {} is not a regular file", path.display()));
    }
    if private && m.mode() & 0o077 != 0 {
        return Err(format!(
            "{what} {} may be read by other users (mode {:o}): `chmod 600` it",
            path.display(),
            m.mode() & 0o7777
        ));
    }
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {what} {}: {e}", path.display()))?;
    Ok(Some(bytes))
}

/// A name in `dir` nobody can guess, for a temporary file beside `path`.
fn temporary_name(path: &Path) -> PathBuf {
    let mut random = [0u8; 8];
    // A failure leaves zeros: the name is still refused if it exists (O_EXCL).
    let _ = getrandom::fill(&mut random);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    folder_of(path).join(format!(
        ".{name}.{}.{:016x}.tmp",
        std::process::id(),
        u64::from_ne_bytes(random)
    ))
}

/// Opens a new file at `path` that nobody else made: it must not exist (`O_EXCL`) and is not
/// followed if it is a link (`O_NOFOLLOW`); its mode is `mode`, whatever the umask.
fn create_new(path: &Path, mode: u32) -> std::io::Result<File> {
    let f = File::options()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(mode))?;
    Ok(f)
}

/// Replaces `path` with `bytes` so that a reader (or a crash) sees the old file or the new one,
/// whole; the new file has `mode`, whatever the umask. Written through a temporary name opened
/// with `O_CREAT|O_EXCL|O_NOFOLLOW` and renamed, so a link planted at any name is never followed.
pub fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    write_through_temporary(path, bytes, mode, |tmp, path| std::fs::rename(tmp, path))
}

/// Makes `path` with `bytes` unless it exists (`AlreadyExists`, and nothing changes), as
/// [`write_atomically`] does: a reader never sees it half written, as it could a file created
/// and then written (two instances making the same token at once).
pub fn write_new(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    write_through_temporary(path, bytes, mode, |tmp, path| {
        let linked = std::fs::hard_link(tmp, path);
        std::fs::remove_file(tmp)?;
        linked
    })
}

/// `bytes` into a temporary name of its own beside `path`, synced, then `put` there (renamed
/// over it, or linked); the temporary name never outlives the call.
fn write_through_temporary(
    path: &Path,
    bytes: &[u8],
    mode: u32,
    put: impl FnOnce(&Path, &Path) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let tmp = temporary_name(path);
    let written = (|| {
        let mut f = create_new(&tmp, mode)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        put(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    File::open(folder_of(path))?.sync_all()
}

/// Opens `path` to be written from its start (a capture): created with `mode` if missing; if it
/// exists it must be a regular file of this user's with no other name, and it is emptied and
/// given `mode`. A symbolic link is never followed. `extra_flags` are added to the open (such as
/// `O_DIRECT`).
pub fn create_output(path: &Path, mode: u32, extra_flags: i32) -> std::io::Result<File> {
    let f = File::options()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | extra_flags)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "{} is a symbolic link: Stitch does not write through links",
                    path.display()
                ),
            ),
            _ => e,
        })?;
    let m = f.metadata()?;
    if !m.is_file() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        ));
    }
    if m.uid() != euid() {
        return Err(Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "{} belongs to uid {}: remove it or write elsewhere (Stitch overwrites only its own files)",
                path.display(),
                m.uid()
            ),
        ));
    }
    if m.nlink() != 1 {
        return Err(Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "{} has {} names (hard links): remove it or write elsewhere",
                path.display(),
                m.nlink()
            ),
        ));
    }
    f.set_len(0)?;
    f.set_permissions(std::fs::Permissions::from_mode(mode))?;
    Ok(f)
}

/// What `stitch check` says of a file a graph names (`key`, its value `path`, relative to
/// the graph file's folder `base_dir`) that is missing or unreadable, quoting the value as it
/// was written; `None` when it can be read.
pub fn missing(key: &str, path: &Path, base_dir: &Path) -> Option<String> {
    let full = base_dir.join(path);
    // A socket is there or not; a file must open too (a socket's open fails, ENXIO).
    let e = match std::fs::metadata(&full) {
        Ok(m) if !m.is_file() => return None,
        Ok(_) => File::open(&full).err()?,
        Err(e) => e,
    };
    let relative = if path.is_relative() {
        " (a relative path is taken from the graph file's folder)"
    } else {
        ""
    };
    Some(format!(
        "{key}: cannot read `{}`: {e}{relative}",
        path.display()
    ))
}

/// The same for the folder a file will be written into.
pub fn missing_folder(key: &str, path: &Path, base_dir: &Path) -> Option<String> {
    let full = base_dir.join(path);
    let folder = full.parent().filter(|d| !d.as_os_str().is_empty())?;
    if folder.is_dir() {
        return None;
    }
    Some(format!(
        "{key}: the folder of `{}` ({}) does not exist",
        path.display(),
        folder.display()
    ))
}

/// Makes `dir` a folder of this user's with `mode` (and group `gid`, when given): created if
/// missing (its parents as usual); refused when it is a symbolic link or belongs to another
/// user; its mode and group are set even when it exists, so a folder left open by another
/// umask is closed again.
pub fn private_dir(dir: &Path, mode: u32, gid: Option<u32>) -> Result<(), String> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    let d = File::options()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| format!("{} is not a folder Stitch can use ({e})", dir.display()))?;
    let m = d
        .metadata()
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    if m.uid() != euid() {
        return Err(format!(
            "{} belongs to uid {}, not to this user (uid {}): another user made it, and would see what Stitch puts there; remove it, or choose another folder",
            dir.display(),
            m.uid(),
            euid()
        ));
    }
    if let Some(gid) = gid {
        std::os::unix::fs::fchown(&d, None, Some(gid))
            .map_err(|e| format!("cannot give {} to group {gid}: {e}", dir.display()))?;
    }
    d.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("cannot set the mode of {}: {e}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode_of(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn a_new_file_is_made_whole_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        write_new(&file, b"first", 0o600).unwrap();
        assert_eq!(mode_of(&file), 0o600);
        let e = write_new(&file, b"second", 0o600).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&file).unwrap(), b"first");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary file is left: {names:?}");
    }

    #[test]
    fn a_file_written_whole_has_its_mode_and_leaves_a_planted_link_alone() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "untouched").unwrap();
        let file = dir.path().join("state");
        // A link at the name the old code wrote through.
        std::os::unix::fs::symlink(&victim, dir.path().join("state.tmp")).unwrap();
        write_atomically(&file, b"new", 0o600).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"new");
        assert_eq!(mode_of(&file), 0o600);
        assert_eq!(std::fs::read(&victim).unwrap(), b"untouched");
        // A link at the name itself is replaced, not followed.
        std::fs::remove_file(&file).unwrap();
        std::os::unix::fs::symlink(&victim, &file).unwrap();
        write_atomically(&file, b"again", 0o640).unwrap();
        assert!(!std::fs::symlink_metadata(&file)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(mode_of(&file), 0o640);
        assert_eq!(std::fs::read(&victim).unwrap(), b"untouched");
        // No temporary file is left.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 3, "{names:?}");
    }

    #[test]
    fn an_output_is_never_written_through_a_link_or_a_second_name() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "untouched").unwrap();
        let link = dir.path().join("capture.pcap");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = create_output(&link, 0o600, 0).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let hard = dir.path().join("hard.pcap");
        std::fs::hard_link(&victim, &hard).unwrap();
        let e = create_output(&hard, 0o600, 0).unwrap_err();
        assert!(e.to_string().contains("hard links"), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"untouched");
        // An old file of this user's is emptied and closed to others.
        let old = dir.path().join("old.pcap");
        std::fs::write(&old, "old bytes").unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut f = create_output(&old, 0o600, 0).unwrap();
        f.write_all(b"x").unwrap();
        assert_eq!(std::fs::read(&old).unwrap(), b"x");
        assert_eq!(mode_of(&old), 0o600);
    }

    #[test]
    fn a_file_others_can_write_or_in_a_folder_others_can_write_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("state");
        std::fs::write(&file, "x").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        check_trusted(&file, "state file").unwrap();
        assert_eq!(
            read_trusted(&file, "state file", true).unwrap().unwrap(),
            b"x"
        );
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = check_trusted(&file, "state file").unwrap_err();
        assert!(e.contains("writable by other users (mode 666)"), "{e}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_trusted(&file, "token file", true).unwrap_err();
        assert!(e.contains("may be read by other users"), "{e}");
        // Its folder open to everyone, even sticky as /tmp: refused; a sticky folder above it
        // is fine (the test's own temporary folder sits in one).
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = check_trusted(&open.join("state"), "state file").unwrap_err();
        assert!(e.contains("writable by other users (mode 1777)"), "{e}");
        let inner = open.join("mine");
        std::fs::create_dir(&inner).unwrap();
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o700)).unwrap();
        check_trusted(&inner.join("state"), "state file").unwrap();
        // A link is refused as the file.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let e = check_trusted(&link, "state file").unwrap_err();
        assert!(e.contains("symbolic link"), "{e}");
        assert_eq!(
            read_trusted(&dir.path().join("none"), "state file", true).unwrap(),
            None
        );
    }

    #[test]
    fn a_private_folder_gets_its_mode_whatever_it_had() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run/stitch");
        private_dir(&run, 0o750, None).unwrap();
        assert_eq!(mode_of(&run), 0o750);
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o777)).unwrap();
        private_dir(&run, 0o700, None).unwrap();
        assert_eq!(mode_of(&run), 0o700);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&run, &link).unwrap();
        let e = private_dir(&link, 0o700, None).unwrap_err();
        assert!(e.contains("is not a folder Stitch can use"), "{e}");
    }
}
