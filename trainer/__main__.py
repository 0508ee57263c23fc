from lazarus.trainer.train import main

main()
