//! `k3mini quickstart`'s inputs: the corpus, prompts and the two recipes it writes load and
//! differ only in their objectives and names; a rerun leaves them untouched. (The whole
//! pipeline's wall time is measured in the README, not timed here.)
use k3mini::quickstart::prepare;
use k3mini::recipe;

#[test]
fn quickstart_recipes_load_and_differ_only_in_objectives() {
    let dir = std::env::temp_dir().join(format!("k3mini-quickstart-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    for fast in [true, false] {
        let out = dir.join(if fast { "fast" } else { "full" });
        let [kd, ce] = prepare(&out, fast, Default::default()).unwrap();
        let (kd, ce) = (recipe::load(&kd).unwrap(), recipe::load(&ce).unwrap());
        assert_eq!(
            kd.shards_dir(),
            ce.shards_dir(),
            "both runs read the same shards"
        );
        assert_eq!(kd.train.steps, if fast { 40 } else { 150 });
        assert_eq!(kd.distill.as_ref().unwrap().objectives.len(), 2);
        assert_eq!(ce.distill.as_ref().unwrap().objectives.len(), 1);
        assert_ne!(kd.out_dir, ce.out_dir);
        for source in &kd.data.sources {
            let text = std::fs::read_to_string(&source.path).unwrap();
            assert!(text.len() > 10_000 && text.ends_with('\n'));
        }
        let stamp = |p: &std::path::Path| std::fs::metadata(p).unwrap().modified().unwrap();
        let before = stamp(&kd.recipe);
        prepare(&out, fast, Default::default()).unwrap();
        assert_eq!(stamp(&kd.recipe), before, "a rerun rewrites nothing");
    }
    std::fs::remove_dir_all(&dir).ok();
}
