//! QEMU's machine protocol (QMP), as much as Stitch speaks of it: asking a guest to power down.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Asks the VM behind QMP socket `qmp` to power down (the ACPI power button). False when QEMU
/// did not take the request.
pub fn power_down(qmp: &Path) -> bool {
    let ask = || -> std::io::Result<bool> {
        let stream = UnixStream::connect(qmp)?;
        stream.set_read_timeout(Some(Duration::from_secs(1)))?;
        let mut writer = stream.try_clone()?;
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line)?; // the greeting
        for command in ["qmp_capabilities", "system_powerdown"] {
            writeln!(writer, "{{\"execute\": \"{command}\"}}")?;
            loop {
                line.clear();
                if reader.read_line(&mut line)? == 0 {
                    return Ok(false);
                }
                // Events may come between; the answer is a `return` or an `error`.
                if line.contains("\"error\"") {
                    return Ok(false);
                }
                if line.contains("\"return\"") {
                    break;
                }
            }
        }
        Ok(true)
    };
    ask().unwrap_or(false)
}
