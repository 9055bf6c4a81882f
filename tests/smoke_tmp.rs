use ferrocomm::prelude::*;
#[test]
fn smoke() {
    let comms = Comm::new_group("cpu", &[Device::Cpu; 3], "smoke", CommOptions::from_env().unwrap()).unwrap();
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let mut x = vec![c.rank() as f32 + 1.0; 100000];
                c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                assert!(x.iter().all(|&v| v == 6.0));
                let mut y = vec![c.rank() as i32; 5];
                c.all_reduce(&mut y, ReduceOp::Max).unwrap();
                assert_eq!(y, vec![2; 5]);
                let mut out = vec![0i64; 6];
                c.all_gather(&mut out, &[c.rank() as i64, 7]).unwrap();
                assert_eq!(out, vec![0,7,1,7,2,7]);
                let v: Vec<String> = c.all_gather_object(&format!("r{}", c.rank())).unwrap();
                assert_eq!(v, vec!["r0","r1","r2"]);
                let mut z = vec![1u8; 10];
                c.scope(|s| {
                    let w = s.all_reduce(&mut z, ReduceOp::Sum).unwrap();
                    w.wait().unwrap();
                });
                assert_eq!(z, vec![3u8; 10]);
            });
        }
    });
}
