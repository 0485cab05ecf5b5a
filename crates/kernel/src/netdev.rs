//! Interfaces: names to indexes, and the loop device the data plane re-enters through.

use std::ffi::CString;
use std::process::Command;

pub fn ifindex(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Creates (if needed) a veth pair `name`/`peer` and brings both up; returns `name`'s ifindex.
/// A veth end rather than a dummy device: veth is in every kernel that runs containers, the
/// dummy module is not.
pub fn ensure_veth(name: &str, peer: &str) -> Result<u32, String> {
    if ifindex(name).is_none() {
        ip(&["link", "add", name, "type", "veth", "peer", "name", peer])?;
    }
    ip(&["link", "set", peer, "up"])?;
    ip(&["link", "set", name, "up"])?;
    ifindex(name).ok_or_else(|| format!("device {name} vanished"))
}

/// Creates (if needed) a collect-metadata VXLAN device on `port` and brings it up.
pub fn ensure_vxlan(name: &str, port: u16) -> Result<u32, String> {
    if ifindex(name).is_none() {
        ip(&[
            "link",
            "add",
            name,
            "type",
            "vxlan",
            "external",
            "dstport",
            &port.to_string(),
        ])?;
    }
    ip(&["link", "set", name, "up"])?;
    ifindex(name).ok_or_else(|| format!("device {name} vanished"))
}

pub fn delete(name: &str) -> Result<(), String> {
    if ifindex(name).is_none() {
        return Ok(());
    }
    ip(&["link", "del", name])
}

/// Creates (if needed) a veth pair that joins the kernel data plane to Stitch's engine, with
/// IPv6 off on both ends (the host would otherwise send router solicitations and MLD reports
/// into the graph), and brings it up.
pub fn ensure_boundary_veth(name: &str, peer: &str) -> Result<(), String> {
    if ifindex(name).is_none() {
        ip(&["link", "add", name, "type", "veth", "peer", "name", peer])?;
    }
    for end in [name, peer] {
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{end}/disable_ipv6"), "1");
        ip(&["link", "set", end, "up"])?;
    }
    Ok(())
}

/// The interfaces of this network namespace whose names start with `prefix`.
pub fn named_with(prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/net")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    names
}
