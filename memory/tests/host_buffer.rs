//! Host buffers sit on whole pages of their own, of this host's page size.

use kvferry_memory::{page_size, HostBuffer};

#[test]
fn the_page_size_is_the_one_the_kernel_reports() {
    // getconf asks sysconf(_SC_PAGESIZE) from another program.
    let out = std::process::Command::new("getconf")
        .arg("PAGESIZE")
        .output()
        .expect("getconf runs");
    let reported: usize = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert_eq!(page_size(), reported);
}

#[test]
fn a_host_buffer_starts_on_a_page_and_owns_whole_pages() {
    let page = page_size();
    for len in [1, 100, page - 1, page, page + 1, 3 * page + 17] {
        let b = HostBuffer::new(len);
        assert_eq!(b.as_slice().as_ptr() as usize % page, 0, "{len} bytes");
        assert_eq!(b.len(), len);
        assert_eq!(b.capacity() % page, 0, "{len} bytes");
        assert!(
            b.capacity() >= len && b.capacity() < len + page,
            "{len} bytes"
        );
        assert!(b.as_slice().iter().all(|&x| x == 0));
    }
    assert_eq!(HostBuffer::new(0).capacity(), 0);
}
